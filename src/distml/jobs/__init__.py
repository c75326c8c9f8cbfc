"""Jobs: what starts and watches processes for a whole task, on top of the cores they run.

Each module is one command's engine: the parameter-server job (:mod:`.ps`), preprocessing
(:mod:`.preprocess`), a federated simulation (:mod:`.fl_simulation`), generation
(:mod:`.generate`), serving replicas (:mod:`.replicas`), fine-tuning (:mod:`.finetune`) and batch
inference (:mod:`.infer`). The cores they drive (shards, coordinators, servers, replicas) live in
their own packages and never import a job.
"""
