#pragma once
#include <string>

namespace accel::test {
/// `llm_data_tool prepare REQUEST.json` (see llm_data_tool_prepare.cpp).
int prepare_command(const std::string& request_path);
}  // namespace accel::test
