"""A simulated GPU fleet under a workload trace: KWOK nodes whose pods the real kube-scheduler binds
and that run, finish and fail on the trace's schedule (``kwok``), the trace (``trace``) and the
operator measured under its churn (``churn``; ``make bench-churn``)."""
