from splitbus.gpu_ops import device

device.prepare()  # before paddle is imported by any test module here
