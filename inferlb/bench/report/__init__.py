"""The bench's figures, shared by every bench and by the simulator: one run's ``RunResult``, its latency
histogram, the comparison table and its rounds, plots, and sums read from Prometheus expositions.
Pure where it can be (no clock, no network) so that a live run and a simulated one are judged alike."""
