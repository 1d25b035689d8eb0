"""meshtrain benchmarks: one script per question, each printing a table and
writing JSON with the machine it ran on to benchmarks/results/."""
