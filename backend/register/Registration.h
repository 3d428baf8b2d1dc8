// Registration entry points that must run after import (not in static initialisers, which
// cannot report errors to Python).
#pragma once

#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

namespace superchip {

// Registers the forwarding kernel for every aten op that has an executor kernel and a
// composite one (Note [Forwarding composite kernels]). Idempotent; returns how many.
int register_executor_kernels();

// Operators outside aten (Note [Other libraries' operators], Registration.cpp), named
// "ns::op" or "ns::op.overload".
// Whether `name` is defined, has a kernel for the executor's dispatch key and a composite one
// that would run on superchip in its place, and takes no Device or Storage argument.
bool executor_kernel_outranked(const std::string& name);
// Every operator for which executor_kernel_outranked holds and that has no superchip kernel.
std::vector<std::string> outranked_executor_kernels();
// Registers the forwarding kernel as `name`'s superchip kernel, for as long as the returned
// library lives.
std::unique_ptr<torch::Library> register_forwarding(const std::string& name);

}  // namespace superchip
