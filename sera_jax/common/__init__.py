"""Shared pieces the settings build on; they import the method at most, never a setting.

* `models`: Flax NNX classifiers and their pure functional view;
* `data`: the input pipelines (digits, synthetic, tfds);
* `optim`: optimizers and learning-rate schedules;
* `sharding`: the device mesh and global batches;
* `plots`: headless matplotlib and the moving average of curves.
"""
