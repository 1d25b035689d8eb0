"""The step-time model: what one optimizer step of a job takes on one kind of machine.

:mod:`.step_time` composes the step from the answers of a :class:`~.machine.Machine`, one per kind
(:mod:`.device_node`, :mod:`.core_share`, :mod:`.cpu_host`) chosen once from the profile;
:mod:`.shared_host` is what the two hosts have in common; :mod:`.stage_work`, :mod:`.network`,
:mod:`.pipeline_window` and :mod:`.pipeline_replay` are what they price with.
"""
