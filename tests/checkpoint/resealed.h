#pragma once
// Damage behind a valid checksum, for tests: a checkpoint's zip records rewritten (valid zip
// checksums), to be re-sealed with ddp::seal_archive, as someone crafting a file would.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

namespace ckpt_test::resealed {

// `zip` with record `path` ("ddp_optimizer_state/code/__torch__.py": a record inside a record)
// passed through `edit`; the writer adds its own version records.
inline std::vector<char> rewrite(const std::vector<char>& zip, const std::string& path,
                                 const std::function<void(std::string&)>& edit) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(zip.data(), static_cast<off_t>(zip.size())));
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    out.insert(out.end(), static_cast<const char*>(bytes), static_cast<const char*>(bytes) + n);
    return n;
  });
  // Our records ("ddp_...") are archives themselves: "ddp_x/y" is record y inside record ddp_x.
  const bool nested = path.rfind("ddp_", 0) == 0 && path.find('/') != std::string::npos;
  const std::string head = nested ? path.substr(0, path.find('/')) : path;
  bool found = false;
  for (const auto& name : reader.getAllRecords()) {
    if (name == "version" || name == ".data/version" || name == ".data/serialization_id" || name == "byteorder") continue;
    auto [data, size] = reader.getRecord(name);
    std::string content(static_cast<const char*>(data.get()), size);
    if (name == head && !nested) edit(content);
    if (name == head && nested) {
      const auto inner = rewrite(std::vector<char>(content.begin(), content.end()), path.substr(head.size() + 1), edit);
      content.assign(inner.begin(), inner.end());
    }
    found = found || name == head;
    writer.writeRecord(name, content.data(), content.size());
  }
  writer.writeEndOfFile();
  EXPECT_TRUE(found) << "no record " << path;
  return out;
}

}  // namespace ckpt_test::resealed
