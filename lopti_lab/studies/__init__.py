"""The lab demo and its studies: the four methods trained side by side on the lab model, then a report.

config  DemoConfig: seeds, methods, report folder, around the one TrainConfig all runs share
pool    the runs trained in worker processes, one progress bar over all their steps
run     run_demo: the warm start, the frozen-batch counterfactual, the runs (resumable), the report
report  the report folder: accuracy tables with 95% intervals, paired differences to GRPO, figures
stats   Student's t intervals without scipy
"""
