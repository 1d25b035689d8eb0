"""Example programs for `spec.trainer.type: custom`, shipped in the trainer image."""
