// The fused kernel's host side as one translation unit: ops.cpp (checks, allocation, the op registrations),
// graph.cpp (sorts, transposes, self-loops) and maps.cpp (the edge terms' per-head maps, the beta gate).
// Compiled apart, each parsed the ATen headers again: 32.7 s of compiler CPU for the three, 26.8 s as one
// (measured, docs/engine.md#building-the-fused-kernel); on two cores this unit runs beside backward.cpp.
#include "ops.cpp"
#include "graph.cpp"
#include "maps.cpp"
