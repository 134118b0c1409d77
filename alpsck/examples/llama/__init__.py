"""A Llama-style reference training whose resumed runs reproduce the losses bit for bit.

``python -m alpsck.examples.llama --help`` lists the flags. In-process use (the SLURM layer)::

    from alpsck.examples.llama.train import TrainConfig, train
    result = train(TrainConfig(...), stop_requested=flag.is_set)

Nothing is imported here, so ``python -m alpsck.examples.llama.plot`` does not load torch.
"""
