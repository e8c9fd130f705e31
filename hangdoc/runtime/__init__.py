"""The in-job side: what runs inside the user's training process.

Everything here is cheap when off, never issues a collective of its own, and contains its own
exceptions. It never imports the offline side (readers, analysis, renderers).
"""
