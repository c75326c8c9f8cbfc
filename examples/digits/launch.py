"""The digits training of ``train.py``, started from Python with ``distml.launch``.

python examples/digits/launch.py
"""

import distml
from train import train

if __name__ == "__main__":
    summary = distml.launch(train, 3, nproc=2, run_name="digits-launch")
    print(f"accuracy {summary['eval']['accuracy']:.3f}, report {summary['report']}")
