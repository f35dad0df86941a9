"""The planner, one package, one module per concept (docs/architecture.md,
"The Python package"): planner (the entry point: plan()), arguments, choices
(what each runs), block_profile (a block's figures and its record for C),
profiling, solve, plan_record (Plan), ranks (figures reduced over a process
group), step_meter (what a training step holds outside its blocks) and
autoplan (planning from a model's own training steps: apply, planned)."""
