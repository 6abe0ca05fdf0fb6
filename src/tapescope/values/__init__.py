"""The value types an option holds, below every stage that acts on them.

`Options` (options.py) holds these; capture, analysis, the reports and the applications read them.
Each module here imports only torch, errors.py and its siblings, so any stage may use them.
"""
