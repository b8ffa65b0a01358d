"""Weight policies (the contract, the built-ins, loading and containing them) and the pick policies ext_proc runs, as the control plane lists and checks them."""
