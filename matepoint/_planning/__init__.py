"""The planner's parts, one module per concept (README, "Python files"):
arguments, choices (what each runs), block_profile (a block's figures and
its record for C), profiling, solve, plan_record (Plan), ranks (figures
reduced over a process group), step_meter (what a training step holds
outside its blocks). ``matepoint._planner`` is the entry point."""
