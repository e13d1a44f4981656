"""Planning a cluster from one machine: the job's ranks simulated on fake tensors (``plan --cluster``)."""
