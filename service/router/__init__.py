"""The `poolserve router` process, the one door clients see. It never parses tensors: it imports
neither the pool core nor the inference folder.
"""
