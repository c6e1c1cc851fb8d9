"""Run training jobs on Slurm: ``config`` (SlurmConfig), ``render`` (slurm/train.sbatch), ``slurm``
(sbatch / squeue / scancel), ``layout`` (the run-directory contract), ``commands`` (submit, status,
cancel). See docs/slurm.md."""
