"""Config files of the binaries (ml_collections `get_config`); see configs/base.py."""
