"""``python -m rlexact.demo``: run the embedded demo (see :mod:`rlexact.demo.run`)."""

from rlexact.demo.run import main

if __name__ == "__main__":
    main()
