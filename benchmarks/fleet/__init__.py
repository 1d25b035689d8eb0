"""The simulated GPU fleet benchmarks (issue #36): KWOK nodes, a workload trace, the runners."""
