"""Starting several processes: ``leantrain launch`` (torchrun) and ``leantrain slurm`` (sbatch)."""
