"""``meshtrain plan --calibrate``: measure this machine into a device profile for the planner."""
