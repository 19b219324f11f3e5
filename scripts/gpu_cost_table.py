"""Print the GPU cost model's tables that docs/gpu.md holds.

Run from the repository root: ``python scripts/gpu_cost_table.py``; paste its output over the
generated block of docs/gpu.md (tests/tools/test_gpu_plan.py checks that they agree).
"""

from logitless.tools.gpu_plan import format_report

if __name__ == "__main__":
    print(format_report())
