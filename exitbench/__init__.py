"""exitbench: when should a recurrent-depth transformer stop thinking about a token?"""
__version__ = "0.1.0"
