// Registration entry points that must run after import (not in static initialisers, which
// cannot report errors to Python).
#pragma once

namespace superchip {

// Registers the forwarding kernel for every aten op that has an executor kernel and a
// composite one (Note [Forwarding composite kernels]). Idempotent; returns how many.
int register_executor_kernels();

}  // namespace superchip
