from __future__ import annotations

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    pass
