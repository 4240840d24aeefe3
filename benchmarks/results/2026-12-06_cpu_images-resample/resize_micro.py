# ad-hoc micro-benchmark (issue 51): thread CPU per call, best of 7 medians of 200 calls; run from the repository root
import io, time, numpy as np
from PIL import Image
import ivy.images as im, ivy.resample as rs
from benchmarks.images_served import photo_jpeg
jpeg, q = photo_jpeg()
def dec():
    img = Image.open(io.BytesIO(jpeg)); img.load(); return img
img = dec()
rs.usable(im._vertical_first)
def bestof(f, n=200, rounds=7):
    meds = []
    for _ in range(rounds):
        ts = []
        for _ in range(n):
            c0 = time.thread_time_ns(); f(); ts.append(time.thread_time_ns() - c0)
        meds.append(np.median(ts))
    return min(meds) / 1e3
for (W, H) in ((640, 480), (480, 640)):
    im2 = img if W == 640 else img.transpose(Image.Transpose.ROTATE_90)
    size = (298, 224) if W == 640 else (224, 298)
    vf = im._vertical_first(W, H, *size)
    box = ((size[1]-224)//2, (size[0]-224)//2, 224, 224)
    print(W, H, "vfirst", vf)
    print("  pillow whole+crop", bestof(lambda: im.center_crop(np.asarray(im2.resize(size, Image.Resampling.BICUBIC)), 224, 224)))
    print("  python crop path ", bestof(lambda: im._resize_crop(im2, size, 3, (224, 224))))
    print("  C                ", bestof(lambda: rs.resize_crop(im2, size, 3, box, vf)))
print("decode", bestof(dec, 100, 5))
print("h only (640x480 -> 298x480 crop 224 cols)", bestof(lambda: rs.resize_crop(img, (298, 480), 3, (0, 37, 480, 224), False)))
print("v only (640x480 -> 640x224 crop 224 cols)", bestof(lambda: rs.resize_crop(img, (640, 224), 3, (0, 208, 224, 224), False)))
print("v only RGB-packed-like (L image 1920x480 -> 1920x224 crop 672)")
L = Image.fromarray(np.asarray(img).reshape(480, 1920))
print("  ", bestof(lambda: rs.resize_crop(L, (1920, 224), 3, (0, 0, 224, 672), False)))
