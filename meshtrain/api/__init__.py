"""The TrainingJob API: spec and status model, cross-field rules, presets, CRD.

Plain data and pure functions; shared by the operator, the trainer and the CLI.
"""
