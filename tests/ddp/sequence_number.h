#pragma once
// Counting a group's collectives by its c10d sequence number, which Gloo advances once per
// collective. ProcessGroup::setSequenceNumberForGroup() starts the count in 1.13 and 2.6; 2.15's
// ProcessGroup has none (sequence numbers start at 0 on every rank; checked: its headers).
#include <type_traits>
#include <utility>

#include <c10/util/intrusive_ptr.h>

namespace ddp::test {

template <typename G, typename = void>
struct sets_sequence_number : std::false_type {};
template <typename G>
struct sets_sequence_number<G, std::void_t<decltype(std::declval<G&>().setSequenceNumberForGroup())>>
    : std::true_type {};

template <typename G>
void start_sequence_number(const c10::intrusive_ptr<G>& group) {
  if constexpr (sets_sequence_number<G>::value) group->setSequenceNumberForGroup();
}

}  // namespace ddp::test
