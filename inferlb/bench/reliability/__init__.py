"""Issue 20's reliability benches: ``inferlb bench faults`` (one fault per run, injected into a fresh
stack under open-loop load) and ``soak`` (the same stack, no fault, steady load for a long time)."""
