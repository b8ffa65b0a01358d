"""``inferlb bench run``: one scenario against every data-plane configuration, fairly (a fresh fleet
each, the same trace, alternating rounds), then the comparison table; the fleet's capacity, and a real
fleet's calibration and verdict. The other live benches reuse its ``ScenarioRunner``."""
