"""lopti_lab: do low-probability tokens over-dominate RL updates of LLMs, and do AR and Lopti fix it?

The package is layered, ground floor first (an import only points down; tests/test_layout.py checks it):

    paths, checks, configs, durable, kk/     files, field checks, config helpers, durable writes, the K&K environment
    bins, methods, objective, theory         probability bins, the method registry, the RL objective, softmax facts
    lean/, models, rollout                   loading a policy, sampling rollouts (the lean CPU decode)
    probes/, toy                             gradient probes and probability shift; the toy policy
    train_config, evaluate, runs, resume     the config, test accuracy, run folders, resuming them
    trainer, counterfactual, pool            the GRPO loop; one frozen batch updated by each method; runs in workers
    lab/, studies/, paper                    the lab model; the demo, hard-lab and mechanism studies; the paper
    plots, notebook, widgets, cli            figures, the notebooks' set-up, ipywidgets panels, the command line
    integrations/                            TRL and verl adapters (objective and kk only)

Importing the top-level package is cheap: submodules load torch only when imported.
"""

__version__ = "0.1.0"
