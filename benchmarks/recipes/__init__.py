"""The recipes of benchmarks/bench_recipes.py (its docstring says what each measures): ``runner`` (settings-free
clock, variants, budget, trainer builders), ``settings`` (full and smoke sizes), ``report`` (rows, table, plot) and one
module per recipe, each exposing ``recipe_<name>(settings, budget, args) -> list[record]``."""
