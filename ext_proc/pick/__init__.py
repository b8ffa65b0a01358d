"""The pick: the router, its chain of filters, scorers and picker, and the cost model it ranks by."""
