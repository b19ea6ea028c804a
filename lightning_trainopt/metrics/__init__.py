"""Pure arithmetic on plain values: throughput, FLOPs, memory accounting, step time, cost, hardware tables."""
