"""The Ray job entrypoint, ``python -m pd.launch CONFIG``: the cluster itself is :mod:`pd.cluster.launch`."""

import sys

from pd.cluster.launch import main

if __name__ == "__main__":
    sys.exit(main())
