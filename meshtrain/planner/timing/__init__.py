"""The step-time model: what one optimizer step of a job takes on one kind of machine."""
