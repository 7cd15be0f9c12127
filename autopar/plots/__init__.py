"""Pictures of the cost model: one iteration as a timeline per pipeline rank and the memory per
GPU by component (`figures.py`), from a schedule simulation that needs no plotting library
(`schedule.py`). matplotlib is the optional `plots` extra, imported only when a figure is drawn."""
