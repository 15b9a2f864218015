// A dry run of a pickle, before LibTorch's unpickler sees it. LibTorch's unpickler trusts its
// input: an opcode that pops an empty stack, a memo index of four billion, a tensor whose sizes
// reach past its storage, or a type tag its parser cannot handle crash the process instead of
// failing (each one does, in a re-sealed checkpoint). So we run the pickle on a shadow
// machine first: the same stack, marks and memo, but values reduced to what a checkpoint can
// hold, and every step checked. Only pickles that pass reach LibTorch.
//
// Nesting is bounded: LibTorch builds and frees nested values recursively, so a
// pickle nesting lists a few hundred thousand deep overflowed the stack. Each value here knows
// how deep it nests; a container is filled before it goes inside another (as every pickler
// writes it), so that depth stays true; and values are freed by a loop, not recursion.
#include "checkpoint/src/pickle_check.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <vector>

namespace ddp {
namespace {

enum class Kind { kNumber, kNone, kString, kTuple, kList, kDict, kGlobal, kStorage, kTensor, kObject };

struct Value {
  explicit Value(Kind k) : kind(k) {}
  ~Value();
  Kind kind;
  std::string text;                           // kString; kGlobal: "module.name"; kObject: its class
  std::vector<std::shared_ptr<Value>> items;  // kTuple, kList; kDict: key, value, ...; kObject: its attributes
  int64_t number = 0;                         // kNumber (ints; floats and bools are 0); kStorage: elements
  bool is_int = false;                        // kNumber
  int depth = 0;                              // containers nested here, this one included (0: not a container)
  bool inside = false;                        // inside another value (so never changed again)
};
using ValuePtr = std::shared_ptr<Value>;

// Frees the values nested in this one with a loop: the stack used stays the same however deep
// they nest. A value still owned elsewhere is only released.
Value::~Value() {
  std::vector<ValuePtr> pending = std::move(items);
  while (!pending.empty()) {
    ValuePtr value = std::move(pending.back());
    pending.pop_back();
    if (value.use_count() == 1) {  // its last owner: take its items before it is freed below
      std::move(value->items.begin(), value->items.end(), std::back_inserter(pending));
      value->items.clear();
    }
  }
}

ValuePtr make(Kind kind) {
  ValuePtr value = std::make_shared<Value>(kind);
  const bool container = kind == Kind::kTuple || kind == Kind::kList || kind == Kind::kDict || kind == Kind::kObject;
  value->depth = container ? 1 : 0;
  return value;
}

// Bytes per element of the storage classes a tensor may name (torch.FloatStorage, ...).
const std::map<std::string, int64_t>& storage_classes() {
  static const std::map<std::string, int64_t> classes = {
      {"torch.DoubleStorage", 8}, {"torch.FloatStorage", 4},  {"torch.HalfStorage", 2},
      {"torch.BFloat16Storage", 2}, {"torch.LongStorage", 8}, {"torch.IntStorage", 4},
      {"torch.ShortStorage", 2},  {"torch.CharStorage", 1},   {"torch.ByteStorage", 1},
      {"torch.BoolStorage", 1},   {"torch.ComplexFloatStorage", 8}, {"torch.ComplexDoubleStorage", 16}};
  return classes;
}

constexpr int kMaxDims = 64;
constexpr std::size_t kMaxTypeDepth = 32;
// Lists, tuples, dicts and objects nest at most this deep. A checkpoint nests fewer than 10
// levels (the optimizer's: object, dict, object, dict, object, dict, a tensor's arguments, its
// sizes), and Python's pickler stops at its recursion limit, 1000 by default; LibTorch handles
// 1000 levels (Corruption.DeepNestingIsRefusedBeforeItIsBuilt loads them).
constexpr int kMaxDepth = 1000;

class ShadowUnpickler {
 public:
  ShadowUnpickler(std::string_view pickle, const PickleRules& rules) : pickle_(pickle), rules_(rules) {}

  void run() {
    while (true) {
      op_at_ = at_;
      const char op = static_cast<char>(read_u(1));
      if (op == '.') break;
      step(op);
    }
    if (!marks_.empty() || stack_.size() != 1) fail("STOP with " + std::to_string(stack_.size()) + " values on the stack");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw PickleError("byte " + std::to_string(op_at_) + ": " + what);
  }

  // --- reading the opcode stream --------------------------------------------------------------------
  uint64_t read_u(std::size_t bytes) {  // little endian
    if (pickle_.size() - at_ < bytes) fail("the pickle ends inside an instruction");
    uint64_t value = 0;
    for (std::size_t i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(static_cast<unsigned char>(pickle_[at_ + i])) << (8 * i);
    at_ += bytes;
    return value;
  }
  std::string read_bytes(uint64_t size) {
    if (pickle_.size() - at_ < size) fail("a string runs past the end of the pickle");
    std::string text(pickle_.substr(at_, static_cast<std::size_t>(size)));
    at_ += static_cast<std::size_t>(size);
    return text;
  }
  std::string read_line() {
    const std::size_t end = pickle_.find('\n', at_);
    if (end == std::string_view::npos) fail("a global's name has no end");
    std::string line(pickle_.substr(at_, end - at_));
    at_ = end + 1;
    return line;
  }

  // --- the stack: pops never reach below the innermost mark ----------------------------------------
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  ValuePtr pop() {
    if (stack_.size() <= floor()) fail("an instruction takes a value from an empty stack");
    ValuePtr value = stack_.back();
    stack_.pop_back();
    return value;
  }
  ValuePtr& top() {
    if (stack_.size() <= floor()) fail("an instruction needs a value on an empty stack");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_to_mark() {
    if (marks_.empty()) fail("an instruction needs a MARK that was never set");
    std::vector<ValuePtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  void push(ValuePtr value) { stack_.push_back(std::move(value)); }
  ValuePtr number(int64_t value, bool is_int) {
    ValuePtr v = make(Kind::kNumber);
    v->number = value;
    v->is_int = is_int;
    return v;
  }
  ValuePtr text(Kind kind, std::string content) {
    ValuePtr v = make(kind);
    v->text = std::move(content);
    return v;
  }
  ValuePtr sequence(Kind kind, const std::vector<ValuePtr>& items) {
    ValuePtr v = make(kind);
    nest(*v, items, "a TUPLE");
    return v;
  }

  // --- nesting: every value put inside another goes through here ------------------------------------
  // `container` gets `items` (`change` names the instruction, for errors). The container must not
  // be inside another value yet: then no value's depth changes once it is nested, and no value
  // comes to contain itself.
  void nest(Value& container, const std::vector<ValuePtr>& items, const std::string& change) {
    if (container.inside) {
      fail(change + " that is already inside another value (no pickler writes one; it would hide how deep values nest)");
    }
    for (const auto& item : items) {
      if (item.get() == &container) fail(change + " of itself");
      container.depth = std::max(container.depth, item->depth + 1);
      item->inside = true;
    }
    if (container.depth > kMaxDepth) {
      fail("lists, tuples, dicts and objects nested " + std::to_string(container.depth) + " deep, more than the " +
           std::to_string(kMaxDepth) + " levels a checkpoint may have (its own nest fewer than 10)");
    }
    container.items.insert(container.items.end(), items.begin(), items.end());
  }

  // --- the memo: LibTorch sizes its table by the largest index, so that is bounded ---------------------
  void put(uint64_t index) {
    if (index > pickle_.size()) fail("memo entry " + std::to_string(index) + " in a pickle of " + std::to_string(pickle_.size()) + " bytes");
    if (index >= memo_.size()) memo_.resize(static_cast<std::size_t>(index) + 1);
    memo_[static_cast<std::size_t>(index)] = top();
  }
  void get(uint64_t index) {
    if (index >= memo_.size() || !memo_[static_cast<std::size_t>(index)]) fail("memo entry " + std::to_string(index) + " was never stored");
    push(memo_[static_cast<std::size_t>(index)]);
  }

  void step(char op) {
    switch (op) {
      case '\x80': read_u(1); return;  // PROTO
      case '\x95': read_u(8); return;  // FRAME
      case '(': marks_.push_back(stack_.size()); return;
      case '0': pop(); return;
      case '1': pop_to_mark(); return;
      case 'K': push(number(static_cast<int64_t>(read_u(1)), true)); return;
      case 'M': push(number(static_cast<int64_t>(read_u(2)), true)); return;
      case 'J': push(number(static_cast<int32_t>(read_u(4)), true)); return;
      case '\x8a': {  // LONG1: a little-endian two's complement integer of up to 8 bytes
        const uint64_t size = read_u(1);
        if (size == 0 || size > 8) fail("an integer of " + std::to_string(size) + " bytes");
        uint64_t raw = read_u(static_cast<std::size_t>(size));
        if (size < 8 && (raw >> (8 * size - 1)) != 0) raw |= ~uint64_t{0} << (8 * size);  // sign-extend
        push(number(static_cast<int64_t>(raw), true));
        return;
      }
      case 'G': read_u(8); push(number(0, false)); return;  // BINFLOAT
      case 'N': push(make(Kind::kNone)); return;
      case '\x88': case '\x89': push(number(0, false)); return;  // NEWTRUE, NEWFALSE
      case 'X': push(text(Kind::kString, read_bytes(read_u(4)))); return;     // BINUNICODE
      case '\x8c': push(text(Kind::kString, read_bytes(read_u(1)))); return;  // SHORT_BINUNICODE
      case ')': push(make(Kind::kTuple)); return;
      case ']': push(make(Kind::kList)); return;
      case '}': push(make(Kind::kDict)); return;
      case 't': push(sequence(Kind::kTuple, pop_to_mark())); return;
      case '\x85': case '\x86': case '\x87': {  // TUPLE1..3
        std::vector<ValuePtr> items(static_cast<std::size_t>(op - '\x85' + 1));
        for (auto item = items.rbegin(); item != items.rend(); ++item) *item = pop();
        push(sequence(Kind::kTuple, std::move(items)));
        return;
      }
      case 'a': { ValuePtr item = pop(); append(top(), {item}); return; }
      case 'e': { auto items = pop_to_mark(); append(top(), items); return; }
      case 's': { ValuePtr value = pop(); ValuePtr key = pop(); set_items(top(), {key, value}); return; }
      case 'u': { auto items = pop_to_mark(); set_items(top(), items); return; }
      case 'q': put(read_u(1)); return;
      case 'r': put(read_u(4)); return;
      case '\x94': put(memo_.size()); return;  // MEMOIZE
      case 'h': get(read_u(1)); return;
      case 'j': get(read_u(4)); return;
      case 'c': { std::string module = read_line(); push(global(module, read_line())); return; }
      case 'R': { ValuePtr args = pop(); ValuePtr callable = pop(); push(reduce(*callable, *args)); return; }
      case '\x81': { ValuePtr args = pop(); ValuePtr type = pop(); push(new_object(*type, *args)); return; }
      case 'b': { ValuePtr state = pop(); build(*top(), state); return; }
      case 'Q': push(persistent_load(*pop())); return;
      default: {
        char code[8];
        std::snprintf(code, sizeof(code), "0x%02x", static_cast<unsigned char>(op));
        fail(std::string("opcode ") + code + ", which no checkpoint contains");
      }
    }
  }

  void append(ValuePtr& list, const std::vector<ValuePtr>& items) {
    if (list->kind != Kind::kList) fail("APPEND to something that is not a list");
    nest(*list, items, "an APPEND to a list");
  }
  void set_items(ValuePtr& dict, const std::vector<ValuePtr>& items) {
    if (dict->kind != Kind::kDict) fail("SETITEM on something that is not a dict");
    if (items.size() % 2 != 0) fail("SETITEMS with a key but no value");
    for (std::size_t i = 0; i < items.size(); i += 2) {
      const Value& key = *items[i];
      if (key.kind != Kind::kString && !(key.kind == Kind::kNumber && key.is_int)) {
        fail("a dict key that is neither a string nor an integer");
      }
    }
    nest(*dict, items, "a SETITEM on a dict");
  }

  // --- globals: only the functions and classes a checkpoint uses ------------------------------------
  ValuePtr global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    static const std::set<std::string> functions = {
        "torch._utils._rebuild_tensor_v2",    "collections.OrderedDict",
        "torch.jit._pickle.build_intlist",    "torch.jit._pickle.build_doublelist",
        "torch.jit._pickle.build_boollist",   "torch.jit._pickle.build_tensorlist",
        "torch.jit._pickle.restore_type_tag"};
    if (!functions.count(full) && !storage_classes().count(full) && !rules_.classes.count(full)) {
      fail("the global " + full + ", which no checkpoint uses");
    }
    return text(Kind::kGlobal, full);
  }

  ValuePtr reduce(const Value& callable, const Value& args) {
    if (callable.kind != Kind::kGlobal) fail("a call of something that is not a function");
    if (args.kind != Kind::kTuple) fail("a call of " + callable.text + " without an argument tuple");
    const std::string& f = callable.text;
    const auto& a = args.items;
    if (f == "torch._utils._rebuild_tensor_v2") return rebuild_tensor(a);
    if (f == "collections.OrderedDict") {
      if (!a.empty()) fail("OrderedDict called with arguments");
      return make(Kind::kDict);
    }
    if (f == "torch.jit._pickle.restore_type_tag") {
      if (a.size() != 2 || a[1]->kind != Kind::kString) fail("restore_type_tag needs a value and a type name");
      const std::string& type = a[1]->text;
      const bool fits = (a[0]->kind == Kind::kDict && type.rfind("Dict[", 0) == 0) ||
                        (a[0]->kind == Kind::kList && type.rfind("List[", 0) == 0);
      if (!fits || !is_known_type(type, rules_.classes)) fail("the type tag \"" + type + "\", which no checkpoint writes there");
      return a[0];
    }
    if (f.rfind("torch.jit._pickle.build_", 0) == 0) {
      if (a.size() != 1 || a[0]->kind != Kind::kList) fail(f + " needs one list");
      const bool tensors = f == "torch.jit._pickle.build_tensorlist";
      for (const auto& item : a[0]->items) {
        if (tensors ? item->kind != Kind::kTensor : item->kind != Kind::kNumber) fail(f + " given a list of the wrong kind");
      }
      return a[0];
    }
    fail("a call of " + f + " as a function");
  }

  // torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, requires_grad, hooks[, metadata])
  ValuePtr rebuild_tensor(const std::vector<ValuePtr>& a) {
    if (a.size() != 6 && a.size() != 7) fail("a tensor rebuilt from " + std::to_string(a.size()) + " arguments");
    if (a[0]->kind != Kind::kStorage) fail("a tensor whose storage is not a storage");
    if (a[1]->kind != Kind::kNumber || !a[1]->is_int || a[1]->number < 0) fail("a tensor with a bad storage offset");
    const Value& sizes = *a[2];
    const Value& strides = *a[3];
    if (sizes.kind != Kind::kTuple || strides.kind != Kind::kTuple || sizes.items.size() != strides.items.size() ||
        sizes.items.size() > kMaxDims) {
      fail("a tensor whose sizes and strides are not two tuples of one length");
    }
    // The last element it reaches must lie inside the storage (LibTorch does not check).
    bool empty = false;
    int64_t last = a[1]->number;
    for (std::size_t d = 0; d < sizes.items.size(); ++d) {
      const Value& size = *sizes.items[d];
      const Value& stride = *strides.items[d];
      if (size.kind != Kind::kNumber || !size.is_int || size.number < 0 || stride.kind != Kind::kNumber ||
          !stride.is_int || stride.number < 0) {
        fail("a tensor with a negative or non-integer size or stride");
      }
      if (size.number == 0) empty = true;
      int64_t reach = 0;
      if (__builtin_mul_overflow(size.number == 0 ? 0 : size.number - 1, stride.number, &reach) ||
          __builtin_add_overflow(last, reach, &last)) {
        fail("a tensor whose sizes and strides overflow");
      }
    }
    if (!empty && last >= a[0]->number) {
      fail("a tensor reaching element " + std::to_string(last) + " of a storage of " + std::to_string(a[0]->number));
    }
    if (a[4]->kind != Kind::kNumber || a[5]->kind != Kind::kDict) fail("a tensor with bad requires_grad or hooks");
    return make(Kind::kTensor);
  }

  // ('storage', torch.XStorage, key, location, elements): the data is the record for `key`, which
  // must hold exactly that many elements.
  ValuePtr persistent_load(const Value& id) {
    const auto& a = id.items;
    if (id.kind != Kind::kTuple || a.size() != 5 || a[0]->kind != Kind::kString || a[0]->text != "storage" ||
        a[1]->kind != Kind::kGlobal || !storage_classes().count(a[1]->text) || a[2]->kind != Kind::kString ||
        a[3]->kind != Kind::kString || a[4]->kind != Kind::kNumber || !a[4]->is_int || a[4]->number < 0) {
      fail("a persistent id that is not ('storage', type, key, location, size)");
    }
    const int64_t element_size = storage_classes().at(a[1]->text);
    const auto record = rules_.storage_size ? rules_.storage_size(a[2]->text) : std::nullopt;
    if (!record) fail("a tensor stored under key \"" + a[2]->text + "\", for which the archive has no record");
    int64_t bytes = 0;
    if (__builtin_mul_overflow(a[4]->number, element_size, &bytes) || static_cast<uint64_t>(bytes) != *record) {
      fail("storage \"" + a[2]->text + "\" of " + std::to_string(a[4]->number) + " elements of " +
           std::to_string(element_size) + " bytes, but its record holds " + std::to_string(*record) + " bytes");
    }
    ValuePtr storage = make(Kind::kStorage);
    storage->number = a[4]->number;
    return storage;
  }

  // TorchScript objects: cls() then BUILD with a dict of attributes.
  ValuePtr new_object(const Value& type, const Value& args) {
    if (type.kind != Kind::kGlobal || !rules_.classes.count(type.text)) fail("an object of a class the archive does not define");
    if (args.kind != Kind::kTuple || !args.items.empty()) fail("an object created with arguments");
    return text(Kind::kObject, type.text);
  }
  void build(Value& object, const ValuePtr& state) {
    if (object.kind != Kind::kObject) fail("BUILD on something that is not an object");
    if (state->kind != Kind::kDict) fail("an object's attributes that are not a dict");
    for (std::size_t i = 0; i < state->items.size(); i += 2) {
      if (state->items[i]->kind != Kind::kString) fail("an attribute name that is not a string");
    }
    nest(object, {state}, "a BUILD of an object");  // LibTorch keeps them in the object
  }

  std::string_view pickle_;
  const PickleRules& rules_;
  std::size_t at_ = 0, op_at_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<std::size_t> marks_;
  std::vector<ValuePtr> memo_;
};

// --- type names: Tensor, int, ..., List[T], Optional[T], Dict[K, V], Tuple[T, ...] ------------------
class TypeParser {
 public:
  TypeParser(std::string_view text, const std::set<std::string>& classes) : text_(text), classes_(classes) {}
  bool parse() { return type(0) && at_ == text_.size(); }

 private:
  bool eat(std::string_view token) {
    if (text_.substr(at_, token.size()) != token) return false;
    at_ += token.size();
    return true;
  }
  std::string_view name() {
    const std::size_t start = at_;
    while (at_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[at_])) || text_[at_] == '_' || text_[at_] == '.')) ++at_;
    return text_.substr(start, at_ - start);
  }
  bool type(std::size_t depth) {
    if (depth > kMaxTypeDepth) return false;
    const std::string_view n = name();
    static const std::set<std::string_view> plain = {"Tensor", "int", "float", "bool", "str", "NoneType"};
    if (plain.count(n) || classes_.count(std::string(n))) return true;
    if (!eat("[")) return false;
    if (n == "List" || n == "Optional") return type(depth + 1) && eat("]");
    if (n == "Dict") return type(depth + 1) && eat(", ") && type(depth + 1) && eat("]");
    if (n == "Tuple") {
      if (eat("()]")) return true;
      do {
        if (!type(depth + 1)) return false;
      } while (eat(", "));
      return eat("]");
    }
    return false;
  }

  std::string_view text_;
  const std::set<std::string>& classes_;
  std::size_t at_ = 0;
};

}  // namespace

void check_pickle(std::string_view pickle, const PickleRules& rules) { ShadowUnpickler(pickle, rules).run(); }

bool is_known_type(std::string_view type, const std::set<std::string>& classes) {
  return TypeParser(type, classes).parse();
}

}  // namespace ddp
