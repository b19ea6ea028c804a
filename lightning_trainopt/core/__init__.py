"""Pure arithmetic and accounting: memory by category, FLOPs, schedules, prices, estimates. No Trainer."""
