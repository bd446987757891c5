"""Offline training on the learner's DeepSpeed pieces: ``asyncrl sft`` and ``asyncrl dpo``.

No generator, buffer or reward worker: a dataset on disk, the same engine, ZeRO stages,
learning-rate schedule, packing, checkpoints, export and loggers as RL. One module per job:

- ``config``: ``OfflineConfig``, the recipe of one run (every field documents itself);
- ``data``: rows (``messages`` lists, prompt/response columns, chosen/rejected pairs) rendered
  with the model's chat template into token ids and a mask of the tokens to learn;
- ``objective``: the ``Objective`` interface (a loss over a batch, with its figures) and its two
  implementations, ``SFTObjective`` and ``DPOObjective``;
- ``micro``: a batch cut into micro batches of whole examples, packed, scored;
- ``reference``: DPO's reference log-probabilities, computed once and cached in the run;
- ``evaluation``: held-out loss and greedy exact match;
- ``state``: checkpoints and resume;
- ``loop``: the training loop that composes them.
"""
