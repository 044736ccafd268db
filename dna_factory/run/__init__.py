"""A run's life: start, train, save, resume and stop, alone or under a launcher.

``runner``        the shared runner: one path for every stage
``resume``        resume that never does the wrong thing
``run_files``     the files a run leaves in its output dir, the one atomic writer and the readers
``run_callbacks`` the Trainer callbacks the runner gives every stage
``interrupt``     Ctrl-C and SIGTERM during training: finish the step, save a checkpoint, stop
``process_group`` child processes in a process group of their own, stopped with their owner
``launch``        ``python launch.py``: accelerate's launcher, ending in one line
"""
