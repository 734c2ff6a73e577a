"""_cost"""
