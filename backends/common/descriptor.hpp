#pragma once
// The descriptor of a built-in backend in one expression (backends/register_builtin.cpp registers them).

#include <accel/backend/backend.hpp>

#include <string>
#include <utility>

namespace accel::backends::detail {

/// A backend named `name` (its `backend:` value) whose engines `factory` makes, with the notices about the
/// config and about each optimizer, and the config's activation-checkpointing switch, where it has them.
inline BackendDescriptor describe(
    std::string name, BackendFactory factory, decltype(BackendDescriptor::notices) notices = {},
    decltype(BackendDescriptor::optimizer_notices) optimizer_notices = {},
    decltype(BackendDescriptor::activation_checkpointing) activation_checkpointing = {}) {
  BackendDescriptor d;
  d.name = std::move(name);
  d.factory = std::move(factory);
  d.notices = std::move(notices);
  d.optimizer_notices = std::move(optimizer_notices);
  d.activation_checkpointing = std::move(activation_checkpointing);
  return d;
}

}  // namespace accel::backends::detail
