"""The benchmarks, run from the repository root as modules: `python -m bench.run w1`.

docs/benchmarks.md says what each script measures and how to run it. Runs write their JSON
to var/bench/ (ignored by git); bench/results/ keeps the few results the docs cite. The
package is not installed with the project (pyproject.toml's setuptools `include` leaves it
out): it is imported from the checkout only.
"""
