#pragma once
// Error messages that quote user input stay short and printable (issue 30, item 3): a value echoed from a
// 10 MB file, a nesting bomb or a binary blob must not make the message itself unreadable.

#include <string>
#include <string_view>

namespace accel::detail {

/// `message` with control characters other than newline and tab escaped (\xNN), every run of more than 200
/// characters without a space cut to its first 160 and last 20 characters around "...(N characters)...",
/// and the whole cut to about 4,000 characters (its start and its end, where the fix is named, kept).
std::string bounded_message(std::string_view message);

}  // namespace accel::detail
