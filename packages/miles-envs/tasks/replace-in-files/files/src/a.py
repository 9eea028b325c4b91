foo = 1
print(foo)
