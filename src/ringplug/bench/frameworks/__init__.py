"""The training benchmarks: ringplug against each framework's own data parallelism (Lightning
against DDP, Keras against tf.distribute), a driver (`*_compare`) and the job it starts on
every rank (`*_job`)."""
