"""tendril's benchmarks: `python -m benchmarks list`, `python -m benchmarks run NAME [--quick] [--out DIR]` and
`python -m benchmarks plot NAME [--results DIR]`.

Cases live in `benchmarks/cases/`, one module each, registered with `@register`. A case measures
tendril and its baselines side by side in one process and reports rows and targets through the
`Context` it is given; the runner adds the machine's description and writes `NAME.json` and `NAME.md`, and
`NAME.png` for the cases in `plots.PLOTS` when matplotlib is installed.
"""
