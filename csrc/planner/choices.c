/* The one table of planner choices: names and what each saves. The cost
 * model (planner.c) gives each its figures; Python reads the table as
 * _C.PLAN_CHOICES and runs each choice by name. A new choice is a row
 * here, its case in the cost model and what it runs in Python. */
#include "planner.h"

const plan_choice_info plan_choice_table[PLAN_CHOICES] = {
    [PLAN_KEEP] = {"keep", "every activation, on the device", -1, 0},
    [PLAN_RECOMPUTE] = {"recompute", "its input, on the device; the rest is recomputed", -1, 0},
    [PLAN_OFFLOAD] = {"offload", "its input, in host memory; the rest is recomputed", -1, 1},
    [PLAN_SELECTIVE] = {"selective",
                        "its input and the outputs of matmuls, convolutions and attention, "
                        "on the device",
                        PLAN_POLICY_SELECTIVE, 0},
    [PLAN_OFFLOAD_SELECTIVE] = {"offload+selective",
                                "what selective saves, in host memory",
                                PLAN_POLICY_SELECTIVE, 1},
    [PLAN_ATTENTION] = {"attention", "its input and the outputs of attention, on the device",
                        PLAN_POLICY_ATTENTION, 0},
    [PLAN_OFFLOAD_ATTENTION] = {"offload+attention", "what attention saves, in host memory",
                                PLAN_POLICY_ATTENTION, 1},
};

const char *const plan_policy_names[PLAN_POLICIES] = {
    [PLAN_POLICY_SELECTIVE] = "selective",
    [PLAN_POLICY_ATTENTION] = "attention",
};
