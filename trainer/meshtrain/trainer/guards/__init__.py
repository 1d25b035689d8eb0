"""Guards of a run: the loss guard, the gradient noise scale, stragglers, graceful stops, fault injection."""
